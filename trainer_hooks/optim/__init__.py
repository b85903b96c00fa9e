"""What describes the trainer's optimizer to the shadow and checks, at attach, that the
replay reproduces it bit for bit (calibrated on the trainer's device)."""
