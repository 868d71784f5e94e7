# The default CPU run trained for any depth (README, "Any depth without fine-tuning"): every iteration
# draws its Euler step count from 3..9, and the time embedding turns 100 x slower than the authors'
# (time_scale 10, not 1000), so that W(t) varies smoothly between the times of different step counts.
# Measured over 1000 iterations: usable from 3 to 16 steps without fine-tuning (2.04-2.12 nats/byte),
# at 0.08 nats/byte above the default run at its own 6 steps.
include("shakespeare.py")
out_dir = "out-anydepth"
train_steps = "3-9"
time_scale = 10.0
