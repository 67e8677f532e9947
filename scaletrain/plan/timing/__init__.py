"""The planner's timing room: bytes each rank communicates per step (`comm`), the alpha-beta
model of collectives (`collectives`) and the step time of a planned layout (`step_time`)."""
