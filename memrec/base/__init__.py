"""The leaf helpers every layer uses: errors and exit codes (errors), the one guarded
creator of every file memrec writes (files), untrusted text (untrusted), the version
(version) and the install command of an optional extra (extras).
"""
