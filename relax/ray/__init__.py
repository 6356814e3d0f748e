"""Ray: placement groups, actor groups, the workers' runtime_env, and job submission."""
