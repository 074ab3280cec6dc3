"""The top layer: the `segserve` command line, the local launcher, the benchmarks and the offline tools.

reflow/: the data-reflow consumer and exports; corpus_build.py; finetune*.py; bench/; client/: the public
Python client, which imports only protos. The services live in router/, scheduler/, worker/ and drafter/,
import only protos and common, and never import this package (pyproject.toml's import-linter contracts).
"""
