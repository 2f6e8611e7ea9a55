"""The exceptions every commlab entry point raises."""


class CommlabError(RuntimeError):
    """Base of every error commlab raises (communication failures, timeouts, misuse)."""


class UnsupportedError(CommlabError, ValueError):
    """An algorithm cannot serve this tensor, op or group.

    Raised before any traffic and from information every rank shares (dtype, op,
    device type, group size), so every rank raises the same error and none is left
    waiting on a peer.
    """


class PeerError(CommlabError):
    """A point-to-point transfer with a named peer failed or ran past the group's timeout."""

    def __init__(self, message: str, *, algorithm: str = "", peer: int | None = None):
        super().__init__(message)
        self.algorithm = algorithm
        self.peer = peer


class CollectiveMismatchError(CommlabError):
    """Ranks entered the same collective with different sizes, dtypes, ops or algorithms."""


# How the text of a mismatch between ranks' calls begins: a peer that learns of it through
# an abort channel (a closed connection, a store key) raises it as a mismatch too.
MISMATCH_MARKS = ("commlab: ranks called differently", "commlab shm: mismatch:")


def raised_for(text: str, algorithm: str = "", peer: int | None = None) -> CommlabError:
    """The error a rank raises for a reason some rank gave the group up with: the same
    text on every rank, and a mismatch found by one rank is a mismatch on every rank."""
    if text.startswith(MISMATCH_MARKS):
        return CollectiveMismatchError(text)
    return PeerError(text, algorithm=algorithm, peer=peer)
