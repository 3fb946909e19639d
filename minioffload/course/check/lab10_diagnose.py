"""Grader for Lab 10's diagnosis task (to be written)."""
