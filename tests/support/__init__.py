"""What the tests share: fakes of the services, tiny models, stacks, certificates, helpers."""
