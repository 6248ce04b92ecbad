"""From a plan to files a person reads or runs: the build directory, the next commands, the Slurm job scripts and the tables of the CLI and docs."""
