# SPDX-License-Identifier: MIT
# engine/model/: model config, safetensors, number formats, weights and the reference GEMV.
libdsv4engine_la_SOURCES += \
	engine/model/config.c engine/model/config.h \
	engine/model/safetensors.c engine/model/safetensors.h \
	engine/model/synth.c engine/model/synth.h \
	engine/model/quant.c engine/model/quant.h \
	engine/model/weights.c engine/model/weights.h engine/model/linear.c \
	engine/model/placement.c engine/model/placement.h \
	engine/model/ep_plan.c engine/model/ep_plan.h

check_PROGRAMS += tests/unit/test_weights
TESTS += tests/unit/test_weights
tests_unit_test_weights_SOURCES = tests/unit/test_weights.c tests/unit/st_writer.h tests/unit/seed_util.h
tests_unit_test_weights_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_weights_LDADD = $(TEST_ENGINE_LIBS)

check_PROGRAMS += tests/unit/test_quant
TESTS += tests/unit/test_quant
tests_unit_test_quant_SOURCES = tests/unit/test_quant.c tests/unit/st_writer.h tests/unit/seed_util.h
tests_unit_test_quant_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_quant_LDADD = $(TEST_ENGINE_LIBS)

check_PROGRAMS += tests/unit/test_config
TESTS += tests/unit/test_config
tests_unit_test_config_SOURCES = tests/unit/test_config.c tests/unit/st_writer.h
tests_unit_test_config_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_config_LDADD = $(TEST_ENGINE_LIBS)

check_PROGRAMS += tests/unit/test_safetensors
TESTS += tests/unit/test_safetensors
tests_unit_test_safetensors_SOURCES = tests/unit/test_safetensors.c tests/unit/st_writer.h tests/unit/seed_util.h
tests_unit_test_safetensors_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_safetensors_LDADD = $(TEST_ENGINE_LIBS)

check_PROGRAMS += tests/unit/test_placement
TESTS += tests/unit/test_placement
tests_unit_test_placement_SOURCES = tests/unit/test_placement.c tests/unit/seed_util.h
tests_unit_test_placement_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_placement_LDADD = $(TEST_ENGINE_LIBS)

check_PROGRAMS += tests/unit/test_ep_plan
TESTS += tests/unit/test_ep_plan
tests_unit_test_ep_plan_SOURCES = tests/unit/test_ep_plan.c
tests_unit_test_ep_plan_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_ep_plan_LDADD = $(TEST_ENGINE_LIBS)

check_PROGRAMS += tests/unit/test_synth
TESTS += tests/unit/test_synth
tests_unit_test_synth_SOURCES = tests/unit/test_synth.c tests/unit/st_writer.h tests/unit/seed_util.h
tests_unit_test_synth_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_synth_LDADD = $(TEST_ENGINE_LIBS)
