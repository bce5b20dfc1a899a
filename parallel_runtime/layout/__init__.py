"""``layout: auto``: the layout each model runs in, from a cost model and the probe's measurements."""
