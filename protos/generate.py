"""Regenerate the Python stubs from the .proto files: `python -m protos.generate`."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "segserve" / "v1"


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under out_dir."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"]
    args += [str(p.relative_to(ROOT)) for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return protos


if __name__ == "__main__":
    generate()
    sys.exit(0)
