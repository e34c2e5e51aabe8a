"""Adapter roots: only files under configured directories are read (lifecycle step 5 trusts this)."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from lora_cache.errors import AdapterChangedError, AdapterPathError, ConfigError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MAX_PATH_BYTES = 4095  # Linux's PATH_MAX, less the NUL
MAX_NAME_BYTES = 255  # one component (NAME_MAX)


def check_path(path: object) -> None:
    """Refuse a path no file system holds before it reaches one: not a string, a NUL byte, too long, a component
    too long. The message shows its start, never all of it."""
    if isinstance(path, Path):
        path = str(path)
    if not isinstance(path, str) or not path:
        raise AdapterPathError(f"adapter path {_start(path)} is empty or not a string; give the adapter's directory")
    if "\0" in path:
        raise AdapterPathError(f"adapter path {_start(path)} holds a NUL byte, which no path can; give the "
                               "adapter's directory")
    size = len(path.encode("utf-8", "surrogateescape"))
    longest = max(len(part.encode("utf-8", "surrogateescape")) for part in path.split("/"))
    if size > MAX_PATH_BYTES or longest > MAX_NAME_BYTES:
        raise AdapterPathError(f"adapter path {_start(path)} is {size} bytes with a component of {longest}; paths "
                               f"are at most {MAX_PATH_BYTES} bytes and each name at most {MAX_NAME_BYTES}: give a "
                               "shorter path")


def _start(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class AdapterRoots:
    """Directories adapters may be read from. Symlinks are resolved before the check, for the adapter's
    directory and for every file read from it (a link to a blob under a root, as the Hugging Face cache
    makes, is fine; one that leaves every root is refused)."""

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
        check_path(path)
        raw = Path(path).expanduser()
        if ".." in raw.parts:
            raise AdapterPathError(f"adapter path {str(path)!r} contains '..'; name it from inside an adapter root "
                                   f"({', '.join(map(str, self.roots))})")
        real = (raw if raw.is_absolute() else self.roots[0] / raw).resolve()
        if not any(real == r or r in real.parents for r in self.roots):
            raise AdapterPathError(f"adapter path {str(path)!r} resolves to {real}, outside the adapter roots "
                                   f"({', '.join(map(str, self.roots))}); move it under a root or add one")
        return real

    def root_of(self, real: Path) -> Path | None:
        """The root that holds the real path ``real``, or None."""
        return next((r for r in self.roots if real == r or r in real.parents), None)

    def confine_file(self, path: Path) -> Path:
        """The real path of the adapter file ``path``: every symlink on the way (the file's own, a chain of
        them, a linked directory) resolved, and the result under a root."""
        real = Path(os.path.realpath(path))
        if self.root_of(real) is None:
            hop = f"a symlink to {os.readlink(path)!r}, " if path.is_symlink() else "through a linked directory, "
            raise AdapterPathError(f"{path} is {hop}which resolves to {real}, outside the adapter roots "
                                   f"({', '.join(map(str, self.roots))}): refused, a file of an adapter is read only "
                                   f"from under a root; copy the file into {path.parent} or add a root that holds it")
        return real

    def open_file(self, real: Path) -> int:
        """A read-only fd of ``real`` (a resolved path under a root), opened by walking from its root with no
        symlink followed: a directory swapped for a link after :meth:`confine_file` is refused, not followed.
        Non-blocking, so a FIFO swapped in cannot hang the open; the caller checks what it opened."""
        root = self.root_of(real)
        assert root is not None and real != root, f"{real} was not confined to a root"
        *dirs, name = real.relative_to(root).parts
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in dirs:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = inner
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise AdapterChangedError(f"{real} changed while it was opened: a part of its path became a symlink "
                                          f"({e.strerror}); refused, not followed: register it again") from e
            raise
        finally:
            os.close(fd)
