"""Regenerate `ps_pb2.py` and `ps_pb2_grpc.py` from `ps.proto`.

    python -m pstrain_runtime.proto.regen            # in place
    python -m pstrain_runtime.proto.regen --out DIR  # elsewhere (the drift test)

The grpcio-tools version used for the committed files is recorded in GENERATED_WITH so
the drift test can skip, rather than fail, when a different version is installed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent.parent  # the directory holding pstrain_runtime/
PROTO = "pstrain_runtime/proto/ps.proto"
GENERATED = ("ps_pb2.py", "ps_pb2_grpc.py")
VERSION_FILE = PACKAGE_DIR / "GENERATED_WITH"


def tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def generate(out_root: Path) -> list[Path]:
    """Run protoc into `out_root` (mirroring the package path); return the files."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{SOURCE_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(SOURCE_ROOT / PROTO),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code} for {PROTO}")
    return [out_root / "pstrain_runtime" / "proto" / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="write here instead of in place")
    args = parser.parse_args(argv)
    if args.out is not None:
        for path in generate(args.out):
            print(path)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copyfile(path, PACKAGE_DIR / path.name)
            print(PACKAGE_DIR / path.name)
    VERSION_FILE.write_text(tools_version() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
