"""The CommDebugMode compatibility layer: torch's API and its report model (no settings, no SDK).
"""
