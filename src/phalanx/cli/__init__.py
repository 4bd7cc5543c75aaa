"""The `phalanx` command: `launch`, `consolidate`, `bench` and `plan`.

Imports no torch: `launch` starts the launcher (phalanx.launch),
`consolidate` imports the checkpoint readers (phalanx.train.checkpoint) only
when it runs, `bench` runs its jobs under `phalanx launch`, and `plan` imports
the planner (phalanx.train.plan) when it runs.

Modules (tests/unit/test_layers.py holds this list to the folder):
- `main`: the console script and `python -m phalanx`, which picks the subcommand
  (and `--version`); `suggest`: the did-you-mean of a mistyped command or flag;
- `phalanx launch`: `launch_cmd` (flags -> `LaunchConfig` -> the agent),
  `launch_flags` (the parser, torchrun's flags and their spellings),
  `rdzvflags` (torchrun's rendezvous flags: where the store is, node ranks);
- `phalanx consolidate`: `consolidate_cmd`;
- `phalanx bench`: `bench` (runs the worlds), `bench_report` (reads their
  timelines), `bench_advice` (what to change, with reasons), `bench_plot`;
- `phalanx plan`: `plan_cmd` (its flags, the model file, the probe job).
"""
