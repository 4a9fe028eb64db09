"""The Slurm backend: one package for everything this project knows of Slurm.

launch: the command line and the submission (`python -m launch.slurm`); render: JobSpec -> sbatch script /
submitit executor (pure); follow: `--wait` to the job's end and its exit status; cluster: every run of
Slurm's tools; states: Slurm's state words in ours; operate: status, logs and cancel; proof: the job's
proof of ownership; task: the callable each Slurm task runs (requeue on preemption or time limit, exit-code
mapping), result: its result record; live and successor: live recovery on Slurm.
"""
