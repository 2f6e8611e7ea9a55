"""One registry per collective: every module of a family's package that defines
ALGORITHM is registered when the package is imported, and the API, backend, benches,
cost model and tests iterate the registry, never a list of names."""
from __future__ import annotations

import importlib
import pkgutil

from commlab.core.errors import UnsupportedError

# Algorithms made from a name's argument, `prefix:argument` (a schedule file):
# prefix -> make(registry, argument). Filled by the modules that make them.
MAKERS: dict = {}


class Registry:
    def __init__(self, collective: str, base, label: str = ""):
        self.collective = collective
        self.base = base  # the family's base class: its busbw_factor is the family's
        self._label = label  # how errors name the family ("all_gather "); all-reduce's say "algorithm"
        self._algorithms: dict = {}

    def api(self) -> tuple:
        """What a family's package offers: (register, names, get, for_device)."""
        return self.register, self.names, self.get, self.for_device

    def discover(self, package: str, path) -> None:
        """Register the ALGORITHM of every module of `package` (sub-packages are other families)."""
        for mod in pkgutil.iter_modules(path):
            if mod.ispkg or mod.name in ("base", "registry"):
                continue
            alg = getattr(importlib.import_module(f"{package}.{mod.name}"), "ALGORITHM", None)
            if alg is not None:
                self.register(alg)

    def register(self, alg):
        if not alg.name or alg.name in self._algorithms:
            raise ValueError(f"commlab: cannot register {self._label}algorithm {alg.name!r} (empty or taken)")
        self._algorithms[alg.name] = alg
        return alg

    def names(self) -> list[str]:
        return [a.name for a in sorted(self._algorithms.values(), key=lambda a: (a.order, a.name))]

    def get(self, name: str):
        try:
            return self._algorithms[name]
        except (KeyError, TypeError):
            prefix, colon, argument = name.partition(":") if isinstance(name, str) else ("", "", "")
            if colon and prefix in MAKERS:
                return MAKERS[prefix](self, argument)
            raise UnsupportedError(
                f"commlab: unknown {self._label}algorithm {name!r}; registered: {', '.join(self.names())}"
            ) from None

    def for_device(self, device_type: str) -> list[str]:
        return [n for n in self.names() if device_type in self._algorithms[n].devices]

    def busbw_factor(self, p: int) -> float:
        """nccl-tests' bus-bandwidth factor of this collective (busbw = algbw·factor)."""
        return self.base.busbw_factor(p)
