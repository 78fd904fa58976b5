"""What the tests share, in one package: test modules import from here (and use the fixtures of
the conftest files), never from one another.

- `config`: tokens, `tiny_config`, `BOTH_TRANSPORTS`
- `tiny`: tiny training tasks and participants in threads (`TinyParticipant`, `run_all`, ...)
- `api`: HTTP clients, uploads, pieces and round waits against a coordinator
- `bodies`: bodies for the receive and publish unit tests
- `intake`: an in-process intake's updates and the sum they must give
- `part_uploads`: an update that travels in several 1 MiB parts, and its reference model
- `secagg`: one securely aggregated site over the API; `secagg_rounds`: whole masked rounds
- `processes`: a coordinator process, the `fedtrain` command
- `zygote`: those processes (and torchrun's ranks) forked from a template that imported torch
- `torchrun`: the one launcher of torchrun groups (rendezvous, environment, output, cleanup)
- `fsdp`: FSDP groups and their checks; `dcp`: DCP checkpoints on a gloo group of one
- `runs`: whole runs several modules share; `merge`: outer-optimizer pieces
- `tls`: a throwaway CA and server certificate; `imports`: heavy modules after some code
- `browser`: the browser tests' page and live run
- `workers/`: the scripts torchrun runs on every rank
"""
