"""One module per chapter: the verification its cells call (parsing runs, comparing, tolerances, claim lines)."""
