"""Ray: placement groups, actor groups, the workers' runtime_env, and job submission.

    placement.py      create_placement (device bundles ordered by node and device), ActorGroup,
                      create_training_actors (one rank per bundle), create_engine_actors (one per
                      tensor-parallel group of bundles), the variables each placed actor gets;
                      worker_failure: which placed actor an error came from, its pid, node and log file;
                      wait_for: ray.get that fails as soon as an actor of the run is gone (or a call
                      runs past its Timeout); ActorGroup.run: a method called on every actor of a
                      group, waited for so; ActorGroup.restart: an actor started again in place
    watch.py          the liveness watch wait_for uses: a process watcher per node and actor group;
                      Timeout, the bound on a call that may hang while its processes run
    runtime_env.py    the one rule for which variables reach workers (used by `relax submit` and placement)
    envcheck.py       `python -m relax.ray.envcheck NAME...`: which of them reach a run's processes
    local_cluster.py  a Ray cluster of one or more nodes on this machine, for tests and the CPU demo

`relax submit` (relax/tools/submit.py) wraps Ray's Jobs API with runtime_env.job_env_vars.
This package's modules import ray; relax.ray itself imports nothing, so `relax submit --help` stays fast.
"""
