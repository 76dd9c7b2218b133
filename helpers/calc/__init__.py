"""Pure calculations: formulas, estimators, ds_config building and checks. No process group, no subprocess; imports
neither ``helpers.rank`` nor the kernel side."""
