"""What a run can tell about itself: replica checks, progress records, timelines."""
