"""Training: objectives, optimizers, train state, the jitted step and the loop."""
