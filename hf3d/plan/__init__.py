"""Which mesh fits: each rank's memory and step cost predicted for every mesh a job allows (`hf3d plan`,
command.py), and the activation bytes a run holds, measured the same way (meter.py)."""
