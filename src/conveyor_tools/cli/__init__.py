"""bin/bench and bin/soak (console scripts ``conveyor-bench``, ``conveyor-soak``)."""
