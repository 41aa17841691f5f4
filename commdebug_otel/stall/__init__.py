"""The stall watchdog: progress per process group, the stall snapshot, torch's Flight Recorder dump and the live cross-
rank verdict.
"""
