"""Adapter roots: only files under configured directories are read (lifecycle step 5 trusts this)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lora_cache.errors import AdapterPathError, ConfigError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass(frozen=True)
class AdapterRoots:
    """Directories adapters may be read from. Symlinks are resolved before the check."""

    roots: tuple[Path, ...]

    def __post_init__(self) -> None:
        if not self.roots:
            raise ConfigError("adapter roots are empty: pass at least one directory (--adapter-root DIR)")
        resolved = tuple(Path(r).expanduser().resolve() for r in self.roots)
        for r in resolved:
            if not r.is_dir():
                raise ConfigError(f"adapter root {r} is not a directory; create it or fix --adapter-root")
        object.__setattr__(self, "roots", resolved)

    def resolve(self, path: str | Path) -> Path:
        """The real path of ``path`` (relative paths are taken from the first root), if it is under a root."""
        raw = Path(path).expanduser()
        if ".." in raw.parts:
            raise AdapterPathError(f"adapter path {str(path)!r} contains '..'; name it from inside an adapter root "
                                   f"({', '.join(map(str, self.roots))})")
        real = (raw if raw.is_absolute() else self.roots[0] / raw).resolve()
        if not any(real == r or r in real.parents for r in self.roots):
            raise AdapterPathError(f"adapter path {str(path)!r} resolves to {real}, outside the adapter roots "
                                   f"({', '.join(map(str, self.roots))}); move it under a root or add one")
        return real
