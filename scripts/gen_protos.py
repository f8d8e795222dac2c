"""Regenerate the Python stubs of protos/pdmesh/v1 into pdmesh/v1 (with .pyi).

Usage: python scripts/gen_protos.py [OUT_DIR]   (default: the repository root)
The generated files are never edited by hand; tests/unit/test_proto_drift.py
regenerates them into a temporary folder and fails when they differ.
"""

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'protos'}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pkg = out_dir / "pdmesh" / "v1"
    init = pkg / "__init__.py"
    init.write_text('"""Generated gRPC stubs of the pdmesh.v1 contract (never edit; run `make proto`)."""\n')
    return sorted(pkg.iterdir())


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path.relative_to(out))
