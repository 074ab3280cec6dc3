"""The wire contracts: checked-in stubs match the .proto files, and every RPC and field is documented."""

from pathlib import Path

from protos.generate import PROTO_DIR, generate


def test_generated_stubs_match_protos(tmp_path: Path):
    generate(tmp_path)
    generated = tmp_path / "protos" / "segserve" / "v1"
    stubs = sorted(p.name for p in generated.iterdir() if p.suffix in (".py", ".pyi"))
    assert stubs, "protoc generated nothing"
    for name in stubs:
        checked_in = PROTO_DIR / name
        assert checked_in.is_file(), f"{name} is generated but not checked in; run `python -m protos.generate`"
        assert checked_in.read_text() == (generated / name).read_text(), f"{name} drifted from its .proto"


def _is_declaration(line: str) -> bool:
    return line.startswith("rpc ") or (line.endswith(";") and "=" in line and not line.startswith(("option", "//")))


def test_every_field_and_rpc_is_documented():
    """A declaration has a comment right above it, or belongs to a documented pair
    (two fields under one comment), or is an alternative of a oneof."""
    for proto in PROTO_DIR.glob("*.proto"):
        lines = [line.strip() for line in proto.read_text().splitlines()]
        in_oneof = False
        for i, line in enumerate(lines):
            if line.startswith("oneof "):
                in_oneof = True
            elif line == "}":
                in_oneof = False
            if in_oneof or not _is_declaration(line):
                continue
            above, two_above = lines[i - 1], lines[i - 2]
            documented = above.startswith("//") or (_is_declaration(above) and two_above.startswith("//"))
            assert documented, f"{proto.name}:{i + 1} is undocumented: {line}"
