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
