"""User commands that read what runs leave behind: evaluate, inspect, report, scaling.

Each is also ``python -m hpcps.<command>``.
"""
