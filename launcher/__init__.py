"""The `zserve` CLI, argument parsing, the supervisor and process management."""
