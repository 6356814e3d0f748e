"""Tools around a run, each a `relax` subcommand or a script: doctor, patches, submit, convert, and the tiny random
models the CPU run and the tests build (tiny_model)."""
