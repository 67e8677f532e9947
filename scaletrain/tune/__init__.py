"""`scaletrain tune`: measure the layouts the search ranks best, on the hardware there is.

The search (`plan.search`) proposes; short profiled trials in fresh `torchrun` processes
measure; successive halving spends the time budget on the layouts that can still win; the
winner is written as a config file and a command. Modules: `flags` (train arguments merged),
`hardware` (the device the search predicts for), `candidates` (the search's layouts as trials),
`trial` (one measured run), `results` (the trials and their correlation with the search),
`halving` (the rounds, the budget, resume, tune.json), `ranking` (rank correlation), `report`
(table, HTML, winner).
"""
