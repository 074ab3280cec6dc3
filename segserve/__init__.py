"""The `segserve` command line, the local launcher and offline tools (reflow/: the data-reflow consumer and
exports; corpus_build.py; checkpoint.py: model resolution, the one module the services may import); the
services live in router/, scheduler/, worker/, drafter/ and never import each other. Keep this file free of
imports: a service importing segserve.checkpoint runs it.
"""
