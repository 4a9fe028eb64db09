"""The Slurm backend: one package for everything this project knows of Slurm.

launch: JobSpec -> sbatch script / submitit executor, submit and --wait (`python -m launch.slurm`);
operate: sacct/squeue/scancel for status, logs and cancel, and the job's proof of ownership;
task: the callable each Slurm task runs (requeue on preemption or time limit, exit-code mapping).
"""
