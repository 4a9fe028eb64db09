"""The ground floor: what every other package may import and what imports nothing of the project above it.

Guarded reads of files a hostile or crashed writer may have left (files), the /proc facts about
processes (procs), storage errors and their one-line wording (storage), and untrusted text made safe to
print or parse (untrusted). Stdlib only; nothing here knows a run dir's layout, a scheduler or torch.
"""
