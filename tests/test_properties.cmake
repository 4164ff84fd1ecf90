# Properties of single GoogleTest tests, which gtest_discover_tests registers only when CTest runs
# (tests/CMakeLists.txt includes this file in CTest after their lists). CTest ignores a name that
# names no test (the test would lose its cost and run under the sanitizers again): a test renamed
# is renamed here too.

# COST: about the seconds a test takes beside another on 2 cores. CTest starts the costliest
# first, so that the long tests overlap with the short ones; without a cost they would run in
# the order they are defined, and on a fresh clone (no timings of an earlier run yet) a long one
# defined late would run alone at the end.
#
# The label "integration": end-to-end runs (whole trainings, launches, failures that wait for
# timeouts) whose checks are about results — the loss falls, a resume is exact, a rank is
# named — taking many seconds more under the sanitizers. They keep the label "unit" (their
# executables are unit-test programs), and scripts/test.sh's sanitizer pass leaves them out
# (-LE integration): the readers of untrusted files, the unit tests and the shorter end-to-end
# runs of the same code (Cli.TrainGenerateAndResume, ImageResumeTwoRanks.*, Launch.*, ...) are
# what it checks for memory errors; the main pass runs them all.
set(shardtrain_test_costs
    # name                                                      cost  integration
    "ImageTrain.FashionMnistCnnLearns"                          60    1
    "Train.LossFallsAndMetricsAreWritten"                       20    1
    "Train.ResumeContinuesTheSameTrajectoryBitForBit"           20    1
    "LaunchTrain.MaxRestartsResumeFromTheLatestCheckpoint"      20    1
    "LaunchFailure.RankSpecificErrorNamesItsRank"               15    1
    "Cli.ExportLoadsBackWithInitFrom"                           12    0
    "Report.CompareOnCpuReportsTheRunsMetrics"                  11    1
    "Cli.FlopsProfilerPrintsTheTable"                           8     1
    "Train.SgdResumeContinuesTheSameTrajectoryBitForBit"        8     1
    "LaunchTrain.RanksLogTheGlobalLossAndTheWholeValidation"    7     1
    "LaunchFailure.SameErrorOnEveryRankIsPrintedOnce"           7     1
    "Launch.ElasticNodesRestartWithoutADeadNode"                6     1
    "LaunchFailure.RankHangingInAGradientReduceScatterIsNamed"  6     1
    "LaunchFailure.RankHangingInAPipelineTransferIsNamed"       6     1
    "Strategies/ImageResume.ContinuesBitForBit/\"dp\""          6     1
    "Strategies/ImageResume.ContinuesBitForBit/\"zero3\""       6     1
    "LaunchFailure.HangingRankIsNamedUnderTheLauncher"          5     1
    "LaunchFailure.HangingRankIsNamedUnderMpirun"               5     1
    "ImageTrain.TwoRanksValidateRankZerosStatistics"            5     1
    "ImageTrain.DropoutFlagSetsTheClassifierDropout"            4     1
    "Train.WallClockBreakdownAccountsForTheStepTime"            4     1)

list(LENGTH shardtrain_test_costs n)
math(EXPR last "${n} - 1")
foreach(i RANGE 0 ${last} 3)
  math(EXPR j "${i} + 1")
  math(EXPR k "${i} + 2")
  list(GET shardtrain_test_costs ${i} name)
  list(GET shardtrain_test_costs ${j} cost)
  list(GET shardtrain_test_costs ${k} integration)
  set_tests_properties("${name}" PROPERTIES COST ${cost})
  if(integration)
    set_tests_properties("${name}" PROPERTIES LABELS "unit;integration")
  endif()
endforeach()
