"""Generated segserve.v1 stubs; edit the .proto files, then run `python -m protos.generate`."""
