"""The `segserve` command line and the local launcher; the services live in router/, scheduler/, worker/, drafter/."""
