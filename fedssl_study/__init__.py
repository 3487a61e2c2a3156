"""Studies: many runs (variants x seeds) of one experiment as real ``flwr run`` runs, and one report of them.

- ``spec``: the study file (a base experiment config, variants as overrides, seeds), validated before any run;
- ``launcher``: submitting a run to a SuperLink (a private local one for simulations, or a named connection),
  watching it and stopping it;
- ``runner``: every (variant, seed) one after another, with progress, skipping finished runs and resuming
  interrupted ones;
- ``report``: ``report.md``, ``report.csv`` and the plots of a study folder or of any set of finished runs;
- ``cli``: the ``fedssl-study`` and ``fedssl-report`` commands.

No training math here, and nothing of it runs inside a ServerApp or ClientApp.
"""
