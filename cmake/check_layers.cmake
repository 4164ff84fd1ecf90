# The layering of src/: every folder is a layer, and a file may include headers of its own folder
# and of lower layers only. Run as `cmake -DSRC=<absolute src dir> -P check_layers.cmake` (the
# build runs it as the target check_layers); fails listing every upward or sideways include.
#
# Lowest first: core; the backends (ops, memory) and the data readers; flat buffers; the
# communicators; models; the run configuration; optimizers; file I/O (atomic files);
# monitors; the parallel strategies; checkpoints (which save and load strategies); the
# trainers; the command line. Folders on one line share a layer and include neither each other.
set(SHARDTRAIN_LAYERS
    "core"
    "backend data"
    "memory"
    "comm"
    "model"
    "config"
    "optim"
    "io"
    "monitor"
    "parallel"
    "checkpoint"
    "train"
    "app")

if(NOT SRC OR NOT IS_ABSOLUTE "${SRC}")
  message(FATAL_ERROR "check_layers.cmake: pass -DSRC=<the absolute path of src/>")
endif()

set(rank 0)
set(order "")
foreach(layer IN LISTS SHARDTRAIN_LAYERS)
  string(REPLACE " " ";" folders "${layer}")
  foreach(folder IN LISTS folders)
    set(RANK_${folder} ${rank})
  endforeach()
  string(REPLACE " " "/" shown "${layer}")
  list(APPEND order "${shown}")
  math(EXPR rank "${rank} + 1")
endforeach()
list(JOIN order " < " order)

file(GLOB_RECURSE files "${SRC}/*.h" "${SRC}/*.cpp" "${SRC}/*.cu")
set(violations "")
foreach(f IN LISTS files)
  file(RELATIVE_PATH rel "${SRC}" "${f}")
  string(REGEX MATCH "^[^/]+" top "${rel}")
  if(rel STREQUAL top)
    continue()  # a file directly in src/
  endif()
  if(NOT DEFINED RANK_${top})
    string(APPEND violations "\n  ${rel}: folder '${top}' is in no layer of cmake/check_layers.cmake")
    continue()
  endif()
  file(STRINGS "${f}" includes REGEX "^#include \"[a-z_]+/")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^#include \"([a-z_]+)/.*" "\\1" dep "${line}")
    if(dep STREQUAL top OR NOT DEFINED RANK_${dep})
      continue()  # its own folder; or a generated or third-party header
    endif()
    if(NOT RANK_${dep} LESS RANK_${top})
      string(REGEX REPLACE "^#include " "" what "${line}")
      string(APPEND violations "\n  ${rel} includes ${what}: '${dep}' is not below '${top}'")
    endif()
  endforeach()
endforeach()

if(violations)
  message(FATAL_ERROR "src/ breaks its layering (${order}):${violations}\nMove what the file "
                      "needs into a lower layer, or the file into a higher one.")
endif()
