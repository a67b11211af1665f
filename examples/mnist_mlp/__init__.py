"""Dryden et al.'s MNIST network, data-parallel with compressed all-reduce."""
