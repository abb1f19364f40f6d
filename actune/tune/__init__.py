"""The tuner: model files, trials, and the search for the largest size that fits."""
