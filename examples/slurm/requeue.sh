# Sourced by train.sbatch and train-multinode.sbatch: run the job's srun step, pass SLURM's warning signal on to it,
# and requeue the job when the run stopped to be resumed.
#
# `#SBATCH --signal=B:USR1@120` sends SIGUSR1 to the batch shell only (none of the job's other processes), 120 s or
# up to a minute more before the time limit. bash runs a trap only between commands, so the step runs in the
# background and the shell waits for it: the signal cuts the `wait` short, the trap passes the signal to srun, srun
# forwards it to its tasks (one `hf3d train` launcher per node), and each launcher to its workers. At the time limit
# (and on `scancel`) SLURM sends SIGTERM to every process of the job, this shell included: the trap on TERM keeps
# the shell alive until the step has ended, so it can still requeue.
#
# hf3d's run, stopped by a signal, finishes its step, saves a checkpoint of it on every rank and ends with 128 + the
# signal: 138 after SIGUSR1, 143 after SIGTERM. Those two requeue the job: SLURM runs this batch script again from
# its beginning, same job id, SLURM_RESTART_COUNT one more, and `checkpoint.resume: auto` continues the run. 0 ends
# the job (the run is complete); any other code is a failure, and ends the job with that code, not requeued.

PREEMPTED_CODES=(138 143)  # 128 + SIGUSR1, 128 + SIGTERM

# hf3d_run_step COMMAND...: run COMMAND (the srun step) in the background, forward SIGUSR1 and SIGTERM to it, and
# set STEP_CODE to its exit code once it has ended.
hf3d_run_step() {
  "$@" &
  STEP_PID=$!
  trap 'STEP_SIGNALLED=1; kill -USR1 "$STEP_PID" 2>/dev/null' USR1
  trap 'STEP_SIGNALLED=1; kill -TERM "$STEP_PID" 2>/dev/null' TERM
  while :; do
    STEP_SIGNALLED=0
    STEP_CODE=0
    wait "$STEP_PID" || STEP_CODE=$?
    # a trapped signal ends `wait` early (128 + signal) with the step still running: wait again. bash keeps the
    # code of a step that has ended, so a second `wait` after the step's end returns the step's own code.
    ((STEP_SIGNALLED)) || break
  done
}

# hf3d_end_job CODE: end the batch script by the run's exit code: requeue the job after a stop for preemption (138,
# 143), exit 0 when the run is complete, CODE otherwise.
hf3d_end_job() {
  local code=$1
  if ((code == 0)); then
    echo "hf3d-slurm: job ${SLURM_JOB_ID}: the run is complete" >&2
    exit 0
  fi
  if [[ " ${PREEMPTED_CODES[*]} " != *" $code "* ]]; then
    echo "hf3d-slurm: job ${SLURM_JOB_ID}: the run failed (exit code $code): not requeued" >&2
    exit "$code"
  fi
  echo "hf3d-slurm: job ${SLURM_JOB_ID}: stopped by SIG$(kill -l "$code") with a checkpoint; requeueing it" \
    "(restart $((${SLURM_RESTART_COUNT:-0} + 1)))" >&2
  # the last command: requeueing a running job ends it (SLURM signals this shell, then puts the job back in the queue)
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    echo "hf3d-slurm: job ${SLURM_JOB_ID}: SLURM refused the requeue (sbatch --requeue, or Requeue=0?): submit" \
      "the same command again to resume" >&2
  fi
  exit "$code"
}
