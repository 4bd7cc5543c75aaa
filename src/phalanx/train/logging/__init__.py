"""What a run logs: the log window, the metric files and trackers, rank
0's progress bar and status lines."""
