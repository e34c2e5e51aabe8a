"""Regenerate the Python code of the gRPC contract: ``python -m lora_cache.api.regen [--check]``.

Run from a source checkout with grpcio-tools installed (``pip install -e '.[dev]'``). Every
``protos/lora_cache/v1/*.proto`` becomes ``lora_cache/api/v1/<name>_pb2.py``, ``_pb2.pyi`` and
``_pb2_grpc.py``. protoc names Python modules after the proto package (``lora_cache.v1``), which
here is ``lora_cache.api.v1``: the generated imports and module names are rewritten to match, and
nothing else is changed. ``--check`` regenerates into a temporary directory and fails if the
checked-in files differ (tests/test_proto.py runs it).
"""

from __future__ import annotations

import argparse
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
PROTO_PACKAGE = "lora_cache/v1"  # directory of the .proto files under PROTO_ROOT = the proto package
OUT = Path(__file__).resolve().parent / "v1"
PY_PACKAGE = "lora_cache.api.v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_IMPORT = re.compile(r"^from lora_cache\.v1 import ", re.MULTILINE)
_MODULE = re.compile(r"(['\"])lora_cache\.v1\.(\w+_pb2)\1")


def proto_files() -> list[Path]:
    files = sorted((PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE}; run from a lora-cache source checkout")
    return files


def rewrite(text: str) -> str:
    """Point generated imports and module names at ``lora_cache.api.v1`` instead of ``lora_cache.v1``."""
    return _MODULE.sub(rf"\1{PY_PACKAGE}.\2\1", _IMPORT.sub(f"from {PY_PACKAGE} import ", text))


def generate(out: Path) -> list[Path]:
    """Run protoc for every proto file; write the rewritten modules into ``out``; their paths."""
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise SystemExit("grpcio-tools is not installed: pip install -e '.[dev]' (or grpcio-tools)") from e
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="lora-cache-protoc-") as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", *(str(p.relative_to(PROTO_ROOT)) for p in proto_files())]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed: {' '.join(args)}")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / PROTO_PACKAGE).iterdir()):
            dst = out / src.name
            dst.write_text(rewrite(src.read_text()))
            written.append(dst)
    return written


def generated_files(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(directory.iterdir()) if p.name.endswith(SUFFIXES)}


def check() -> list[str]:
    """Names of generated files that differ from (or are missing in, or extra in) the package."""
    with tempfile.TemporaryDirectory(prefix="lora-cache-regen-") as tmp:
        generate(Path(tmp))
        fresh, current = generated_files(Path(tmp)), generated_files(OUT)
    return sorted(n for n in fresh.keys() | current.keys() if fresh.get(n) != current.get(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lora_cache.api.regen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the checked-in code is not up to date")
    ns = parser.parse_args(argv)
    if ns.check:
        stale = check()
        if stale:
            print(f"generated code is stale: {', '.join(stale)}; run python -m lora_cache.api.regen", file=sys.stderr)
            return 1
        print("generated code is up to date")
        return 0
    for path in generate(OUT):
        print(path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
