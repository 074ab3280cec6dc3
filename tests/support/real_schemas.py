"""Real-world JSON schemas: SchemaStore's configuration formats as check-jsonschema vendors them
(tests/data/schemas, whose README says where each comes from), each file whole and each of its definitions as a
schema of its own (the file's definitions beside a `$ref` to one of them)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

SCHEMAS_DIR = Path(__file__).parents[1] / "data" / "schemas"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # a definition's name that a `$ref` can carry unescaped


@functools.cache
def real_world_schemas() -> dict[str, dict]:
    """Name -> schema: "<file>" for each file, "<file>#/definitions/<name>" (or $defs) for each definition, in a
    stable order."""
    schemas = {}
    for path in sorted(SCHEMAS_DIR.glob("*.json")):
        root = json.loads(path.read_text())
        schemas[path.stem] = root
        kept = {key: root[key] for key in ("$schema", "$id", "definitions", "$defs") if key in root}
        for key in ("definitions", "$defs"):
            for name, definition in root.get(key, {}).items():
                if isinstance(definition, dict) and _PLAIN_NAME.match(name):
                    schemas[f"{path.stem}#/{key}/{name}"] = {**kept, "$ref": f"#/{key}/{name}"}
    return schemas
