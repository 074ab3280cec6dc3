"""Runtime utilities every service may use, and nothing above them.

Beside protos/ at the bottom of the layers (pyproject.toml's import-linter contracts): common imports no
first-party package but protos. In: configuration values and gRPC servers or channels. Out:
- blocking.py: where a servicer runs a blocking call (on its event loop when short, else in a thread);
- catalog.py: the models prepared by name (their pinned packages, GGUF sha256, chat template, stop tokens);
- checkpoint.py: model resolution (a directory, or a catalog model's GGUF converted once into a cache);
- discovery.py: replica addresses (`dns:///name:port`) and rendezvous hashing;
- grammar.py: how a structured output becomes a grammar, alike in the router's check and the worker's compiler;
- schema_exactness.py: which grammar engine enforces a JSON schema exactly (each gap named with its JSON pointer),
  over schema_walk.py (subschemas, pointers, local $refs) and schema_disjoint.py (oneOf branches proved apart);
- health.py: the gRPC health protocol and reflection;
- heap.py: the garbage collector's start-up freeze;
- redact.py: redaction of personal data and secrets in recorded text;
- tls.py: TLS credentials, secure ports and channels;
- tracing.py: OpenTelemetry traces (one provider per process, W3C context between the services).
"""
