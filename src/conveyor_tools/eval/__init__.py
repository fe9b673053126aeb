"""bin/eval's task set and scoring (:mod:`.tasks`) and its runs through a server and transformers (:mod:`.runs`)."""
