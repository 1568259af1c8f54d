# tools/run_model.c: dsv4-run --model
dsv4_run_SOURCES += tools/run_model.c
