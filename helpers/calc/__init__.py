"""Pure calculations: formulas, estimators, ds_config building and checks, parallel-degree rules. No process group,
no subprocess, no environment; imports neither ``helpers.rank`` nor the kernel side, and no torch or DeepSpeed: what
they say comes in as arguments (:mod:`helpers.rank.deepspeed_facts` reads it)."""
