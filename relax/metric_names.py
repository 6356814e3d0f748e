"""What a metric's name says about combining its values: the training ranks combine their micro-batches' metrics
(relax.train.actor) and the loop its optimizer steps' (relax.run.loop) by the same rule."""


def extreme(key: str) -> str | None:
    """"max" or "min" for a metric that is an extreme over a batch (its name ends in _max or _min), None for
    the others. Values of one metric from parts of a batch (micro-batches, data-parallel ranks, optimizer
    steps) combine by that extreme; the others are shares that add up, or means that average."""
    for suffix in ("max", "min"):
        if key.endswith(f"_{suffix}"):
            return suffix
    return None
