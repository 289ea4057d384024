"""Shared set-up of modelzoo's tests: no test may reach the hub."""

from torchmind_modelzoo.env import force_offline

force_offline()  # before any test imports transformers or diffusers
