"""In the notebook kernel: environment probes and verdict, plots, widgets, exercises, the course runner and report.
Every rank is a subprocess started by ``helpers.launch``; nothing here initialises CUDA."""
